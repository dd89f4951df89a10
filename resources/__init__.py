"""What runs where: the resource file, GPU probing, worker plans and the Dask cluster.

    from resources import load_resource_config
"""

from resources.config import ResourceConfig, ResourceConfigError, RoleSpec
from resources.validate import load_resource_config, parse_resource_config, with_role

__all__ = ["ResourceConfig", "ResourceConfigError", "RoleSpec", "load_resource_config",
           "parse_resource_config", "with_role"]
