"""What a run writes on disk: checkpoints and their folder (checkpoint.py, checkpoint_dir.py), the
model, optimizer and RNG state inside them (state.py), the recorded batch stream (stream.py), run
names and what `--overwrite` may remove (run_dir.py). Imports the shared room, the engine and the
contracts; the core imports it."""
