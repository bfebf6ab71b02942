"""Simulations of cluster services for the demos and the tests; not controller backends.

``replicheck.simulation.kubernetes`` is a simulated Kubernetes API server (in memory, plain
HTTP on 127.0.0.1) and ``replicheck.simulation.kubernetes_demo`` plays the recovery story of
the ``kubernetes`` backend against it. Nothing in the product imports this package: it sits
above the controller (it drives a real ``Controller``) and, like the controller, never imports
torch.
"""
