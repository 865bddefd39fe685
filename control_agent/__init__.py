"""Control agent: applies the parameter values the interface daemon sends."""
