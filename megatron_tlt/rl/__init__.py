"""The RL algorithms (GRPO advantages, PPO-family losses) and, later, the RL loop."""
