"""The answer machinery every answer-side strategy and benchmark shares: reading an answer out of a reply
(extract.py), what kind of answer a question asks for and when two answers agree (kinds.py), samples, votes and the
stopping rules (votes.py), a sample's confidence from its token numbers (confidence.py), and the rules that read it
(decide.py: filter, weigh, pick). Pure functions over text and numbers: no engine, no request."""
