"""syncless: observe large-scale PyTorch training without slowing it down."""

from syncless.hot_path import hot_path

__version__ = "0.1.0"

__all__ = ["__version__", "hot_path"]
