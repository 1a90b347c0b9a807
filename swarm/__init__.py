"""swarm: volunteers pool their GPUs to train one language model together with DiLoCo over a peer-to-peer network."""

__version__ = "0.2.0"
