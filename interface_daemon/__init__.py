"""The interface daemon: decodes every agent's messages, is the only writer of the
replay DB, checks and broadcasts the engine's actions, and serves the gRPC control plane.
"""
