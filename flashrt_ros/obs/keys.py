"""The keys of a dict observation, as in a LeRobot batch: shared by the policy protocol, the
image checks and the node, and importable without torch (the node checks its parameters before
torch loads)."""

STATE_KEY = "observation.state"
IMAGE_PREFIX = "observation.images."
