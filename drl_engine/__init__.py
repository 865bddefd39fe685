"""The DRL engine: deep Q-learning over the replay DB (thesis §5.1.4–5.1.7)."""
