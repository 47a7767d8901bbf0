"""Every task's reward and what it is judged with: math answers and their symbolic comparison
bounded in time (math_answer.py, bounded_verify.py), TL;DR's reward models (reward_model.py,
tldr.py), red-teaming's reward with its victim and toxicity classifiers (redteam.py,
toxicity.py), sentence embeddings for diversity (embed.py). Runs in generators, reward workers and
the trainer's evaluation; imports the engine and the contracts, never the runtime."""
