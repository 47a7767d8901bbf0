"""TBA (Bartoldson et al. 2025) and the GRPO baseline: their losses as pure functions (loss.py) and the trainer's hooks (algo.py). Sees only common/contracts/."""
