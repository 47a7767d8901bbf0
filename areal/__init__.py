"""AReaL (Fu et al. 2025): decoupled PPO and the losses it is ablated against, as pure functions (loss.py), and the trainer's hooks (algo.py). Sees only common/contracts/."""
