"""One process holds, loads, saves, runs and samples a model here; nothing in it knows another process exists."""
