"""The config tree, as files (Hydra reads the YAML). A regular install ships it as the package
data ``stratagem_conf``; ``core.conf.CONF_DIR`` finds it either way."""
