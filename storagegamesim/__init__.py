"""StorageGameSim: the simulated storage system of the converge test (thesis §5.2.2),
and ClusterSim, its multi-node sibling with workload phases (issue 11)."""
from storagegamesim.cluster import ClusterConfig, ClusterSim
from storagegamesim.game import GameConfig, StorageGameSim
from storagegamesim.phases import ClusterPhase, GamePhase, Workload

__all__ = ["GameConfig", "StorageGameSim", "ClusterConfig", "ClusterSim", "ClusterPhase",
           "GamePhase", "Workload"]
