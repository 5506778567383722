"""Online RL with verifiable rewards (GRPO, Dr. GRPO, DAPO): a recipe's ``rl:`` section (docs/rl.md)."""
