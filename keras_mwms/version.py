"""The keras_mwms release (kept equal to pyproject.toml's version).

Example:

>>> __version__.count(".") >= 1
True
"""

__version__ = "0.1.0"
