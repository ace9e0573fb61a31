"""pip install of the ROS-free core (runtime, capsules, policies, replay tools).

The ROS package itself is built by colcon from package.xml / CMakeLists.txt (`make setup`);
this file is for machines without ROS, e.g. the GPU benchmark machine: `pip install -e .`.
"""

from setuptools import setup

setup(
    name="flashrt_ros",
    version="0.1.0",
    description="Stateful robot policy as a captured CUDA graph with execution-state capsules",
    python_requires=">=3.10",
    packages=[
        "flashrt_ros",
        "flashrt_ros.runtime",
        "flashrt_ros.cuda",
        "flashrt_ros.obs",
        "flashrt_ros.capsules",
        "flashrt_ros.policies",
        "flashrt_ros.replay",
        "flashrt_ros.sim",
        "flashrt_ros.demo",
        "flashrt_ros.node",
    ],
    package_data={"flashrt_ros.policies": ["weights/*"]},
    include_package_data=True,
    install_requires=["numpy", "torch"],
    entry_points={
        "console_scripts": [
            "flashrt-replay = flashrt_ros.replay.replay_cli:main",
            "flashrt-bagdiff = flashrt_ros.replay.bagdiff_cli:main",
            "flashrt_node = flashrt_ros.node.main:main",
        ]
    },
    zip_safe=False,
)
