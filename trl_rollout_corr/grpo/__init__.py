"""TRL's synchronous GRPOTrainer with rollout correction: the trainer and its config."""
