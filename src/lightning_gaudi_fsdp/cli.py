def main() -> int:\n    return 0
