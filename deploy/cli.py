def main() -> None:
    print("isthmus")
