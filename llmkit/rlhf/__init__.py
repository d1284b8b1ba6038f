"""RLHF: losses and advantages, rewards, rollouts on the inference engine, and the trainers."""
