"""The task layer every task script uses (task.py, run_config.py, the entry train.py, replay.py, evaluate.py,
data.py) over the rooms below it (docs/internals.md, "Layout"). Importing it sets one thing for the process: in a
Jupyter kernel without ipywidgets, `tqdm.auto` (which transformers and huggingface_hub import)
warns "IProgress not found" and falls back to its text bar, which works in a notebook too; that
fallback is kept quiet."""
import warnings

from tqdm import TqdmWarning

warnings.filterwarnings("ignore", message="IProgress not found", category=TqdmWarning)
