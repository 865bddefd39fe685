"""CAPES: continuous, unsupervised parameter tuning of storage systems with deep RL."""
__version__ = "0.1.0"
