"""The DRA driver's side of the Kubernetes API server: configuration, ResourceSlices, ResourceClaims.

Everything here runs in a DRA driver process, never in the agent: it needs the
``dra`` extra (lightkube, chosen by ``bench/bench_kubeclient.py``; pyproject.toml
says why). :mod:`.config` finds the API server and the node the way client-go
programs do, :mod:`.slices` keeps this node's ResourceSlices equal to the
driver's devices, :mod:`.claims` reads what the scheduler allocated to a claim.
"""
