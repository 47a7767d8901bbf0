"""Task definitions (data, prompts, rewards) used by the run scripts and generator processes."""
