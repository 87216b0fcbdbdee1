"""The engine side: fetch a rank's weights from a daemon as torch tensors."""

from wcache.client.client import CachedWeights, WCacheClient

__all__ = ["CachedWeights", "WCacheClient"]
