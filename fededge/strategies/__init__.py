"""Flower strategies built on the pure pieces (local SGD, delayed averaging, gossip,
compression wrappers). Strategy construction from the run config lives in
``fededge.strategies.registry``."""
