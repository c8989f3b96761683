"""Model zoo, loader and identity."""
