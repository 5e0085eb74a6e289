"""Built-in models. Every model is a ``SplitModel``: ``features`` (extractor) then ``head`` (classifier)."""
from .base import SplitModel, feature_dim

__all__ = ["SplitModel", "feature_dim"]
