"""Services the routers call; built in the app factory and kept on `app.state`."""
