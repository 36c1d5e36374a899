"""The shared test harness: reference runs computed once per suite run (:mod:`.refcache`),
the training-script callbacks (:mod:`.callbacks`), the loss log (:mod:`.losses`) and process
launching (:mod:`.launch`)."""
