from torchtitan_rl.config.job_config import JobConfig
from torchtitan_rl.config.manager import ConfigManager, config_to_dict, write_resolved_config

__all__ = ["JobConfig", "ConfigManager", "config_to_dict", "write_resolved_config"]
