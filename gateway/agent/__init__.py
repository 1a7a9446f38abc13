"""The agent plane: sampling calls (chat, text, Responses, Messages), capture, episodes, rewards."""
