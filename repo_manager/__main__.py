from repo_manager.cli import main

main()
