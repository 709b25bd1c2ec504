"""minicpm4-jax: MiniCPM4 (arXiv 2506.07900) in JAX / Flax NNX."""

import os as _os

__version__ = "0.1.0"

# ``ops/``, ``train/``, ``eval/`` and ``configs/`` sit beside this package in the source tree and install as
# ``minicpm4_jax.ops`` etc. (pyproject's package-dir mapping). Without an install (``PYTHONPATH=.`` on a
# machine that must not install anything, e.g. the GPU check) the repository root joins this package's search
# path so the same names resolve; an installed copy has no such siblings and is unaffected.
_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "ops", "__init__.py")) and _ROOT not in __path__:
    __path__.append(_ROOT)
