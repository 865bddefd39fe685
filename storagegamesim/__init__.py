"""StorageGameSim: the simulated storage system of the converge test (thesis §5.2.2)."""
from storagegamesim.game import GameConfig, StorageGameSim

__all__ = ["GameConfig", "StorageGameSim"]
