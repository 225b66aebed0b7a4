from repo_manager.entry import main

main()
