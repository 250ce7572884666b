"""Sensors: tasks that wait until a condition is true, one module per family as in
``triggers/`` (each sensor waits on the trigger of its family when deferred).

* :mod:`~operators.sensors.base`: ``BaseSensorOperator`` (poke, reschedule and deferrable
  mode, the timeout, soft_fail), ``SensorTimeout``, ``SensorConditionFailed``;
* :mod:`~operators.sensors.temporal`: ``DateTimeSensor``, ``TimeDeltaSensor``;
* :mod:`~operators.sensors.file`: ``FileSensor``;
* :mod:`~operators.sensors.http`: ``HttpSensor``;
* :mod:`~operators.sensors.sql`: ``SqlSensor``;
* :mod:`~operators.sensors.external_task`: ``ExternalTaskSensor``;
* :mod:`~operators.sensors.python`: ``PythonSensor`` (also re-exported by ``operators.python``);
* :mod:`~operators.sensors.bash`: ``BashSensor``.

``from operators.sensors import FileSensor`` (and every name below) is the public path.
"""

from operators.sensors.base import BaseSensorOperator, SensorConditionFailed, SensorTimeout
from operators.sensors.bash import BashSensor
from operators.sensors.external_task import ExternalTaskSensor
from operators.sensors.file import FileSensor
from operators.sensors.http import HttpSensor
from operators.sensors.python import PythonSensor
from operators.sensors.sql import SqlSensor
from operators.sensors.temporal import DateTimeSensor, TimeDeltaSensor

__all__ = [
    "BaseSensorOperator",
    "BashSensor",
    "DateTimeSensor",
    "ExternalTaskSensor",
    "FileSensor",
    "HttpSensor",
    "PythonSensor",
    "SensorConditionFailed",
    "SensorTimeout",
    "SqlSensor",
    "TimeDeltaSensor",
]
