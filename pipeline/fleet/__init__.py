"""The driver's view of who runs where, with one owner: the Fleet (see fleet.py)."""

from pipeline.fleet.fleet import Fleet
from pipeline.fleet.reconcile import ResourceChange, ResourceRequest
from pipeline.fleet.tasks import RoleTimeout

__all__ = ["Fleet", "ResourceChange", "ResourceRequest", "RoleTimeout"]
