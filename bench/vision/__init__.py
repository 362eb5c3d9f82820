"""`tandem bench vision`: image chats against text chats of the same token count."""
