"""The roof: applications that stand on the components.

The demo (the whole stack as processes), the converge test, offline training, plots,
the process group the demo and benchmarks use, and the replay tools. Components never
import from here.
"""
