"""Models in and out: Hugging Face checkpoints read into the decoder and complete directories written
back (hf_io.py, hf_save.py, hf_layouts.py), the published shapes of the papers' models and random
models of them (shapes.py), the tiny model (tiny_model.py). Imports the model room and the contracts."""
