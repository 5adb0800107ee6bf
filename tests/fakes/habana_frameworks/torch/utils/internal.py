import habana_frameworks.torch as bridge


def is_lazy() -> bool:
    return bridge._LAZY_AT_LOAD
