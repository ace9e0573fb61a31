"""Launch the flashrt node: `ros2 launch flashrt_ros flashrt.launch.py [namespace:=arm] ...`.

device:=... and trigger:=... override the params file only when given; left empty, the params
file decides (so a robot's own YAML is never silently overridden by a launch default). The node
checks every parameter (`flashrt_node --help` lists them) and exits with status 2 on a bad one.

fastdds_profile:=auto (the default) gives the node config/fastdds_images.xml as its Fast DDS
profile (camera images over shared memory whole; the file says why) unless the environment
already names one in FASTDDS_DEFAULT_PROFILES_FILE; a path uses that file; an empty value leaves
the environment alone.

A params_file:= that names no file stops the launch with an error (launch_ros alone would warn
and start the node on its defaults: another policy, rate and joints than the robot's).
"""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node

from flashrt_ros.node.fastdds import PROFILE_VAR, fastdds_env, installed_profile
from flashrt_ros.node.params import NODE_PARAMS, checked_params_file


def _override(name: str) -> str:
    return f"override: {NODE_PARAMS[name].accepts()} (empty: the params file decides)"


def _node(context):
    env = fastdds_env(
        LaunchConfiguration("fastdds_profile").perform(context),
        dict(os.environ),
        installed_profile(),
    )
    overrides = {
        key: LaunchConfiguration(key).perform(context)
        for key in ("device", "trigger")
        if LaunchConfiguration(key).perform(context)
    }
    return [
        Node(
            package="flashrt_ros",
            executable="flashrt_node",
            name="flashrt",
            namespace=LaunchConfiguration("namespace"),
            # a missing file is an error: launch_ros would warn and start the node on defaults
            parameters=[
                checked_params_file(LaunchConfiguration("params_file").perform(context)),
                overrides,
            ],
            remappings=[
                ("joint_states", LaunchConfiguration("joint_states_topic")),
                ("commands", LaunchConfiguration("commands_topic")),
                ("goal", LaunchConfiguration("goal_topic")),
            ],
            additional_env=env,
            output="screen",
        )
    ]


def generate_launch_description():
    default_params = os.path.join(
        get_package_share_directory("flashrt_ros"), "config", "flashrt.yaml"
    )
    args = [
        DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
        DeclareLaunchArgument(
            "params_file", default_value=default_params, description="parameters YAML file"
        ),
        DeclareLaunchArgument("device", default_value="", description=_override("device")),
        DeclareLaunchArgument("trigger", default_value="", description=_override("trigger")),
        DeclareLaunchArgument(
            "joint_states_topic", default_value="joint_states", description="observation topic"
        ),
        DeclareLaunchArgument(
            "commands_topic", default_value="commands", description="command topic"
        ),
        DeclareLaunchArgument("goal_topic", default_value="goal", description="goal topic"),
        DeclareLaunchArgument(
            "fastdds_profile",
            default_value="auto",
            description="Fast DDS profile of the node: auto (config/fastdds_images.xml unless "
            f"{PROFILE_VAR} is set), a file, or empty (the environment decides)",
        ),
    ]
    return LaunchDescription([*args, OpaqueFunction(function=_node)])
