"""Where the package's shipped data lives: recorded GPU results and tuned kernel configs."""
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
