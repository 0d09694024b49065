"""The e2e scenarios: one scenario code, two backends (an emulated node offline, a kind cluster)."""
