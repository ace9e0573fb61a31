"""Observation assembly from robot messages, without ROS (the node and the replay tools)."""
