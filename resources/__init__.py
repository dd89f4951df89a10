"""What runs where: the resource file, GPU probing, worker plans and the Dask cluster.

    from resources import load_resource_config
"""

from resources.config import ResourceConfig, ResourceConfigError, RoleSpec, load_resource_config

__all__ = ["ResourceConfig", "ResourceConfigError", "RoleSpec", "load_resource_config"]
