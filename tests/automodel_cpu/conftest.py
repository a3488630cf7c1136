import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # cpu_patches

try:
    import nemo_automodel  # noqa: F401
except ImportError:  # the main venv has no AutoModel: `make test-automodel` runs these in .venv-automodel
    collect_ignore_glob = ['test_*.py']
