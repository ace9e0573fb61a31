"""The flashrt closed-loop demo: the built-in policy drives the simulated arm, and a small planner
checkpoints, branches, rolls out and restores the policy's execution state while it runs.

    make demo                       # = python -m flashrt_ros.demo
    make demo POLICY=builtin:act    # the visuomotor policy, on the sim arm's camera
    python -m flashrt_ros.demo --out /tmp/demo --duration 30 --rate 50 --domain-id 77
    python -m flashrt_ros.demo.plot OUT_DIR     # re-plot a finished run

It starts ``flashrt_sim_arm`` and ``flashrt_node`` (timer trigger) as subprocesses in a DDS domain
of its own, kept on this machine (ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST), and always stops them
(SIGINT, then kill) at the end, also on errors and Ctrl-C. The planner (an rclpy node in this
process) records joint_states and runs this story, timed as fractions of ``--duration``:

1. goal A;
2. ``checkpoint`` "before_goal_b" (pinned) before the goal change; ``branch`` it into sessions
   try_b (goal B) and try_c (goal C) and ``rollout`` both, closed loop on observations that a copy
   of the arm model predicts, to compare the alternatives without touching the robot;
3. goal B; a few seconds later the move to B is declared failed (simulated);
4. ``restore`` "before_goal_b" into the live session: the policy's execution state (observation
   history, recurrent state, action queue, goal, step counter) goes back to the checkpoint. The arm
   does not teleport: the restored policy drives it back toward A from where it is;
5. ``branch`` "before_goal_b" into session plan_c with goal C and activate=True: the live commands
   now come from the branch.

Every service call's round-trip time is measured. At the end it prints a summary and writes, in
``--out``: demo.png (joint positions, goals, events), summary.json, joint_states.csv (the recorded
positions) and the logs of both nodes (sim_arm.log, flashrt_node.log).

``--policy`` (default builtin:hybrid) picks the policy the node serves. The demo loads it first
to read its inputs: for each ``observation.images.<name>`` input the sim arm publishes
``camera/<name>/image_raw`` (rgb8, the input's height and width: the arm, and the goal drawn as
a ghost) and the node subscribes it (``cameras``). A policy without a goal input (builtin:act
reads the goal from the image) gets its goals through the camera only, and with images the
what-if part (2: try_b / try_c and their rollouts) is skipped, as ``~/rollout`` takes vector
observations only; the summary says so (story.py). With cameras the planner also snapshots the
first camera at the story's moments: camera_frames.npz, and a row of frames in demo.png.
Exit status: 0 when every capsule operation succeeded, 1 when one failed or a node ended during
the story, 2 when the nodes did not come up, 130 when interrupted.

Modules: cli (options, main), children (the node subprocesses), planner (the rclpy client),
story (the scripted checkpoint / branch / rollout / restore), summary (summary.json and the
printed summary), trajectory (the recorded joint positions, joint_states.csv), plot (demo.png),
policy_info (the served policy's cameras and capsule contents, read from the policy).
This file imports nothing, so ``flashrt_ros.demo.plot`` and ``.trajectory`` load without ROS.
"""


class DemoError(RuntimeError):
    """Something the demo cannot go on from (a node down, a service silent); said to the user."""
