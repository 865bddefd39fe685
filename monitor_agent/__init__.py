"""Monitoring agent: collects a node's performance indicators and streams them to the
interface daemon. Never imports torch: it must stay light on the nodes it watches."""
