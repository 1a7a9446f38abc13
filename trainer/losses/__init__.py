"""Policy losses, each returning (loss, metrics); engines call `policy.policy_loss`."""
