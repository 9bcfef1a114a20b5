sotr names.txt > out.txt
