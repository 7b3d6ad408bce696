def run_records(cfg, out=None):
    raise NotImplementedError
