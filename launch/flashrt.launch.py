"""Launch the flashrt node: `ros2 launch flashrt_ros flashrt.launch.py [namespace:=arm] ...`."""

import os

from ament_index_python.packages import get_package_share_directory
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node


def generate_launch_description():
    default_params = os.path.join(
        get_package_share_directory("flashrt_ros"), "config", "flashrt.yaml"
    )
    args = [
        DeclareLaunchArgument("namespace", default_value="", description="node namespace"),
        DeclareLaunchArgument(
            "params_file", default_value=default_params, description="parameters YAML file"
        ),
        DeclareLaunchArgument(
            "device", default_value="auto", description='"auto" | "cuda" | "cuda:N" | "cpu"'
        ),
        DeclareLaunchArgument(
            "trigger", default_value="timer", description='"timer" | "observation"'
        ),
        DeclareLaunchArgument(
            "joint_states_topic", default_value="joint_states", description="observation topic"
        ),
        DeclareLaunchArgument(
            "commands_topic", default_value="commands", description="command topic"
        ),
        DeclareLaunchArgument("goal_topic", default_value="goal", description="goal topic"),
    ]
    node = Node(
        package="flashrt_ros",
        executable="flashrt_node",
        name="flashrt",
        namespace=LaunchConfiguration("namespace"),
        parameters=[
            LaunchConfiguration("params_file"),
            {
                "device": LaunchConfiguration("device"),
                "trigger": LaunchConfiguration("trigger"),
            },
        ],
        remappings=[
            ("joint_states", LaunchConfiguration("joint_states_topic")),
            ("commands", LaunchConfiguration("commands_topic")),
            ("goal", LaunchConfiguration("goal_topic")),
        ],
        output="screen",
    )
    return LaunchDescription([*args, node])
